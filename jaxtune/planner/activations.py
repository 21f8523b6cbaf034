"""What one training step keeps for its backward pass (`saved_tensors`, `activation_bytes`), and what the backward of
one layer needs on top, counted against jaxtune's own forward (`models/llama.py`). Layers run under `lax.scan`, so what
the backward needs from a layer is stacked [L, ...]; the attention core and the gated MLP's activation are recomputed in
the backward, so scores are never kept per layer. Per layer and token, remat "none" keeps what a backward reads (x,
rotated q and k, v, gate and up, the attention kernel's output and log-sum-exp, each trained module's input, LoRA's x
A); "save_matmuls" x and the weight matmuls' outputs; "full" x. A mixture counts its K routed experts and shared expert
as the MLP's width; a Gated DeltaNet layer its own set (`linear_layer_saved`). The backward's workspace
(`BACKWARD_SHARE`, `ATTENTION_COPIES_F32`, ...) was measured on XLA:CPU by experiments/planner_accuracy.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from jaxtune.config import ModelConfig
from jaxtune.methods.base import adapted_modules, method_unit
from jaxtune.models.attention import block_size
from jaxtune.models.head import chunk_length
from jaxtune.models.params import linear_shapes

# One layer's backward workspace, as a multiple of that layer's no-remat activation set (measured on XLA:CPU).
BACKWARD_SHARE = {"none": 0.8, "save_matmuls": 0.85, "full": 1.3}
# Float32 [b, H, bq, bk] blocks one layer's attention backward holds beside one in the compute dtype (measured on
# XLA:CPU): scores, probabilities and their gradients; under save_matmuls the kernel's forward is recomputed apart.
ATTENTION_COPIES_F32 = {"none": 4, "save_matmuls": 2, "full": 4}
# The same for a row of one block, which runs with no loop (`attention._scan_blocks`) and keeps no loop buffers or
# accumulators: under save_matmuls one block fewer (fitted on XLA:CPU to the compiled steps of tests/test_planner.py
# and tests/parallel_worker.py, 128 and 256 tokens).
ONE_BLOCK_COPIES_F32 = {"none": 4, "save_matmuls": 1, "full": 4}
# [b, T, F] float32 arrays one layer's backward holds where the base's weights train, on XLA:CPU: the inputs of the
# weight gradients' matmuls laid out again, transposed (measured at 8k tokens on three Llama shapes, within 3%)
WEIGHT_GRADIENT_COPIES = {"none": 3.0, "save_matmuls": 3.0, "full": 1.6}
# [b, c, V] float32 logits buffers a final-logit soft cap adds at the loss (tanh's output, kept for the backward),
# measured on XLA:CPU (Gemma 2 shapes): one with adapters; 0.2 to 2 in full fine-tuning (bfloat16, float32).
SOFTCAP_LOGITS_COPIES = 1
# The [rows of the expert group, T, K x D] arrays of a megablox mixture whose experts are frozen (the sorted inputs,
# Llama 4's weighted ones, the experts' outputs, and in the backward their gradients in their place): held once each,
# outside BACKWARD_SHARE and the TPU compiler's second layer (DeepSeek-V3's LoRA compiled for v5p-512 with 4, 8 and
# 16 devices an expert group: 2.2 and 10.0 GiB more temporaries for 5.7 and 11.3 GiB more of the group's tensors,
# experiments/tpu_compile_table.py)
EXPERT_STREAMS = ("their expert inputs", "their expert outputs", "their weighted expert inputs")
# Remat "offload": the layer inputs on the device at once, of the [L, b, T, D] stack in host memory: the one the
# backward reads and the next one being fetched.
OFFLOAD_LAYERS_ON_DEVICE = 2


@dataclass(frozen=True)
class Widths:
    """Per-device sizes of one micro-batch: rows b, tokens T, keys S (prefix + T), and the tensor-split widths.

    On a context axis of N devices T is a device's share of a row's tokens (seq_len / N) and S the keys one call of
    the attention kernel sees: the ring's block, or every token gathered (`strategy`)."""

    b: int
    T: int
    S: int
    D: int
    q: int
    kv: int
    F: int
    V: int
    heads: int
    kv_heads: int
    head_dim: int
    megablox: bool = False  # a mixture's experts run megablox (TPU): its internals are no matmuls a policy saves
    expert_rows: int = 1  # the rows a device's experts see, as multiples of its own (gathered over the expert axis)
    context: int = 1
    strategy: str = "ring"
    mlp_tile: int = 0  # `[model] tiled_mlp`: the MLP's tokens a row at a time (0: all T)
    fused_low_rank: bool = False  # LoRA branches folded into their base products (`linear.dense` on CPU)
    whole_kernel: bool = False  # a method hook needs the whole kernel (DoRA): its branch's output is read again

    @property
    def Tm(self) -> int:
        """The tokens a row the MLP holds at once: a tile of a tiled MLP, else T."""
        return self.mlp_tile if 0 < self.mlp_tile < self.T else self.T


def mlp_width(cfg: ModelConfig) -> int:
    """The MLP width a token passes through: intermediate_size, or a mixture's K experts' and shared expert's (and
    Gemma 4's MLP beside them)."""
    if not cfg.num_experts:
        return cfg.intermediate_size
    return (cfg.experts_per_token * cfg.expert_size + cfg.shared_expert_size
            + cfg.intermediate_size * cfg.experts_beside_mlp)


def gemma4_kinds(cfg: ModelConfig, w: Widths) -> dict[tuple[bool, bool], tuple[ModelConfig, Widths, int]]:
    """Gemma 4's layer kinds, (full attention of its own width, a double-wide MLP): each kind's config (its
    attention's view), widths and number of layers."""
    tensor = cfg.num_heads // w.heads
    kinds: dict[tuple[bool, bool], tuple[ModelConfig, Widths, int]] = {}
    for i in range(cfg.num_layers):
        kind = (i in cfg.global_layers, cfg.wide_shared_mlp and i in cfg.kv_sharing_layers)
        if kind in kinds:
            kinds[kind] = (*kinds[kind][:2], kinds[kind][2] + 1)
            continue
        view = cfg.global_view if kind[0] else cfg
        K = view.num_kv_heads // tensor if view.num_kv_heads % tensor == 0 else view.num_kv_heads
        F = w.F + (cfg.intermediate_size // tensor if cfg.intermediate_size % tensor == 0 else cfg.intermediate_size)
        kinds[kind] = (view, replace(w, head_dim=view.head_dim, kv_heads=K, q=w.heads * view.head_dim,
                                     kv=K * view.head_dim, F=F if kind[1] else w.F), 1)
    return kinds


def widths(cfg: ModelConfig, rows: int, seq_len: int, prefix: int, tensor: int, megablox: bool = False,
           expert: int = 1, context: int = 1, strategy: str = "ring", mlp_tile: int = 0,
           fused_low_rank: bool = False, whole_kernel: bool = False) -> Widths:
    """Widths on one device when heads, MLP columns and the vocabulary are split `tensor` ways (where they divide,
    as jaxtune.parallel's rules split the weights); with `megablox` a mixture's rows are gathered over the `expert`
    devices that split its experts (`models/moe.py`); a row's tokens split over `context` devices, whose attention
    crosses them by `strategy` (`models/context_attention.py`); a dense MLP tiled `mlp_tile` tokens a row at a time
    (`llama.tiled_mlp`; a mixture's is counted untiled); `fused_low_rank`: LoRA branches folded into their base
    products."""
    split = lambda n: n // tensor if n % tensor == 0 else n
    heads_split = cfg.num_kv_heads % tensor == 0
    T = seq_len // context  # a multiple of 2 x context (`config.run.context_split_error`)
    S = prefix + (seq_len if strategy == "all_gather" else T)
    return Widths(rows, T, S, cfg.hidden_size, split(cfg.q_size), split(cfg.kv_size),
                  split(mlp_width(cfg)), split(cfg.vocab_size),
                  cfg.num_heads // tensor if heads_split else cfg.num_heads,
                  cfg.num_kv_heads // tensor if heads_split else cfg.num_kv_heads, cfg.head_dim,
                  megablox and bool(cfg.num_experts),
                  expert if megablox and cfg.num_experts and cfg.num_experts % expert == 0 else 1,
                  context, strategy, 0 if cfg.num_experts else mlp_tile, fused_low_rank, whole_kernel)


def _trains_input(method, module: str, adapted: dict) -> bool:
    """Whether the backward needs `module`'s input: its weights train, or an adapter on it reads it."""
    return method_unit(method).costs.trains_input(method, module, adapted)


def mlp_terms(cfg: ModelConfig) -> set[str]:
    """The names of `saved_tensors`' entries that live inside the MLP (a tiled MLP holds them a tile at a time)."""
    modules = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
    return {"gate", "up", "SwiGLU output"} | {f"{m} x A{ab}" for m in modules for ab in ("", " B")}


def saved_tensors(cfg: ModelConfig, method, policy: str, w: Widths) -> list[tuple[str, tuple[int, ...], bool]]:
    """One layer's saved activations as (name, shape, is_float32) with shapes [b, T, ...] on one device; under a
    tiled MLP, none of the MLP's own: each tile is recomputed from its input, the normalised x."""
    if w.Tm < w.T:
        saved = [t for t in saved_tensors(cfg, method, policy, replace(w, mlp_tile=0)) if t[0] not in mlp_terms(cfg)]
        if policy == "none" and not any(name == "post-attention norm output" for name, _, _ in saved):
            saved.append(("post-attention norm output", (w.b, w.T, w.D), False))
        return saved
    b, T = w.b, w.T
    hd = w.head_dim
    q_shape, kv_shape = (b, T, w.heads, hd), (b, T, w.kv_heads, hd)
    out_width = {"q_proj": q_shape, "k_proj": kv_shape, "v_proj": kv_shape, "o_proj": (b, T, w.D),
                 "gate_proj": (b, T, w.F), "up_proj": (b, T, w.F), "down_proj": (b, T, w.D),
                 "qkv_proj": (b, T, w.q + 2 * w.kv), "gate_up_proj": (b, T, 2 * w.F)}
    adapted = adapted_modules(method, cfg.layer_stacks())
    unit = method_unit(method)
    lora = adapted if unit.costs.low_rank else {}
    trains_input = lambda module: _trains_input(method, module, adapted)
    saved = [("x", (b, T, w.D), False)]
    if policy == "full":
        return saved
    if policy == "save_matmuls":
        saved += [("q", q_shape, False), ("k", kv_shape, False), ("v", kv_shape, False),
                  ("o_proj out", (b, T, w.D), False), ("gate", (b, T, w.F), False), ("up", (b, T, w.F), False)]
        for m in lora:
            saved.append((f"{m} x A", (b, T, lora[m]), False))
            # (down_proj's output only meets the residual add; a folded branch is its module's output)
            if (m != "down_proj" or w.whole_kernel) and not w.fused_low_rank:
                saved.append((f"{m} x A B", out_width[m], False))
    else:
        saved += [("x after attention", (b, T, w.D), False), ("q rotated", q_shape, False),
                  ("k rotated", kv_shape, False), ("v", kv_shape, False), ("gate", (b, T, w.F), False),
                  ("up", (b, T, w.F), False), ("norm statistics", (b, T, 2), True)]
        if cfg.sandwich_norms or cfg.post_norms:  # Gemma, OLMo: sub-layer outputs normalised before the add
            saved += [("attention block output", (b, T, w.D), True), ("MLP block output", (b, T, w.D), True),
                      ("output norm statistics", (b, T, 2), True)]
        if cfg.qk_norm or cfg.qk_l2_norm:  # Qwen3, Gemma 3, OLMo, Llama 4: the q/k norms' float32 inputs, statistics
            saved += [("q before its norm", q_shape, True), ("k before its norm", kv_shape, True),
                      ("query and key norm statistics", (b, T, w.heads + w.kv_heads), True)]
        if any(trains_input(m) for m in ("q_proj", "k_proj", "v_proj", "qkv_proj")):
            saved.append(("input norm output", (b, T, w.D), False))
        if any(trains_input(m) for m in ("gate_proj", "up_proj", "gate_up_proj")):
            saved.append(("post-attention norm output", (b, T, w.D), False))
        if unit.trains_base:
            saved += [("normalised x", (b, T, w.D), False), ("normalised x after attention", (b, T, w.D), False)]
        if trains_input("o_proj"):
            saved.append(("attention output", q_shape, False))
        if trains_input("down_proj"):
            saved.append(("SwiGLU output", (b, T, w.F), False))
        saved += [(f"{m} x A", (b, T, lora[m]), False) for m in lora]
    if cfg.kv_lora_rank and policy != "full":  # latent attention: its latents, their norms, the expanded keys, values
        rope, q_rank = cfg.qk_rope_head_dim, cfg.q_lora_rank
        saved += [("key-value latent", (b, T, cfg.kv_lora_rank + rope), False),
                  ("keys and values expanded", (b, T, w.heads * (hd - rope + cfg.v_head_dim)), False)]
        saved += [("query latent", (b, T, q_rank), False)] if q_rank else []
        if policy == "none":
            saved += [("normed key-value latent", (b, T, cfg.kv_lora_rank), False),
                      ("latent norm statistics", (b, T, 4), True)]
            saved += [("normed query latent", (b, T, q_rank), False)] if q_rank else []
    if cfg.num_experts and policy != "full":
        K = cfg.experts_per_token
        saved.append(("router probabilities", (b, T, cfg.num_experts), True))
        if cfg.router_choice_bias:  # DeepSeek's router in float32: its input, its sigmoid scores
            saved += [("router input in float32", (b, T, w.D), True), ("router scores", (b, T, cfg.num_experts), True)]
        if policy == "none" or not w.megablox:
            saved += [("tokens sorted by expert", (b, T, K * w.D), False), ("expert outputs", (b, T, K * w.D), False)]
            if cfg.expert_input_scaled:  # Llama 4: the sorted tokens times their weights, the experts' input
                saved.append(("weighted expert inputs", (b, T, K * w.D), False))
        if policy == "none":
            saved += expert_group_tensors(cfg, w)
        elif w.megablox:  # save_matmuls: megablox's products are recomputed, not saved (its kernel is no dot)
            shared = w.F - cfg.experts_per_token * cfg.expert_size * w.F // mlp_width(cfg)  # this device's share
            saved = [t for t in saved if t[0] not in ("gate", "up")]
            saved += [("shared expert gate", (b, T, shared), False), ("shared expert up", (b, T, shared), False)
                      ] if shared else []
    return saved + unit.costs.saved(method, adapted, out_width, b, T, w.D)


ATTENTION_TERMS = ("q", "k", "v", "o_proj out", "q rotated", "k rotated", "q before its norm", "k before its norm",
                   "query and key norm statistics", "attention output", "input norm output")
LINEAR_CHUNK = 64  # `gated_deltanet.chunk_gated_delta_rule`'s chunk
# [C]-wide float32 blocks a token and value head the rule's linearisation keeps (decays, scores, the system, their
# masks and exponentials, the solves' operands), and three copies of each chunk's starting state: counted in its
# residuals on XLA:CPU (issue 50)
RULE_BLOCKS = 14


def linear_layer_saved(cfg: ModelConfig, method, policy: str, w: Widths) -> list[tuple[str, tuple[int, ...], bool]]:
    """One Gated DeltaNet layer's saved activations (`saved_tensors`' set with the linear attention's in place of
    attention's): under "none" the projections' outputs, the convolution's, the rule's output and the gated norm's
    inputs, and the chunked rule's float32 residuals (normalised q and k, v, three [C]-wide blocks a token — decays,
    the in-chunk scores, the triangular system — the two solves, and the [dk, dv] state each chunk starts from);
    under "save_matmuls" the projections' outputs; under "full" x alone."""
    adapted = adapted_modules(method, cfg.layer_stacks())
    attention_adapters = {f"{m} x A" for m in adapted if m in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")}
    shared = [t for t in saved_tensors(cfg, method, policy, w)
              if t[0] not in ATTENTION_TERMS and t[0] not in attention_adapters and not t[0].startswith(
                  tuple(f"{m} x A" for m in ("q_proj", "k_proj", "v_proj", "o_proj")))]
    if policy == "full":
        return shared
    b, T, N = w.b, w.T, cfg.linear_num_value_heads
    C, values, dk, dv = (2 * cfg.linear_key_size + cfg.linear_value_size, cfg.linear_value_size,
                         cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    projections = [("linear qkv", (b, T, C), False), ("linear z", (b, T, values), False),
                   ("linear beta and decay", (b, T, 2 * N), True), ("linear out_proj out", (b, T, w.D), False)]
    if policy == "save_matmuls":
        return shared + projections
    padded = -(-T // LINEAR_CHUNK) * LINEAR_CHUNK
    rule = [("linear convolution output", (b, T, C), False), ("linear rule output", (b, T, values), False),
            ("linear gated norm statistics", (b, T, N), True),
            ("linear rule q, k", (b, N, padded, 2 * dk), True), ("linear rule v", (b, N, padded, dv), True),
            ("linear rule blocks", (b, N, padded, RULE_BLOCKS * LINEAR_CHUNK), True),
            ("linear rule solves", (b, N, padded, dk + 2 * dv), True),
            ("linear chunk states", (b, N, 3 * padded // LINEAR_CHUNK, dk, dv), True)]
    if any(m.startswith("linear_attn.in_proj") for m in adapted) or method_unit(method).trains_base:
        rule.append(("input norm output", (b, T, w.D), False))
    return shared + projections[:3] + rule


def expert_group_tensors(cfg: ModelConfig, w: Widths) -> list[tuple[str, tuple[int, ...], bool]]:
    """What a layer's megablox mixture holds beyond its own rows' share when the rows of its expert group are
    gathered (`models/moe.py`): the other devices' tokens, their K expert inputs, gate and up, SwiGLU outputs and
    expert outputs (zero where another device's experts take them, but there), Llama 4's weighted inputs, and the
    group's float32 sums."""
    others = w.b * (w.expert_rows - 1)
    if not others:
        return []
    K, T, D, Fe = cfg.experts_per_token, w.T, w.D, cfg.expert_size * w.F // mlp_width(cfg)  # a device's share
    group: list[tuple[str, tuple[int, ...], bool]] = [
        ("the expert group's rows", (others, T, D), False), ("their expert inputs", (others, T, K * D), False),
        ("their gate and up", (others, T, 2 * K * Fe), False), ("their SwiGLU output", (others, T, K * Fe), False),
        ("their expert outputs", (others, T, K * D), False),
        ("the group's weighted sums", (w.b * w.expert_rows, T, D), True)]
    return group + ([("their weighted expert inputs", (others, T, K * D), False)] if cfg.expert_input_scaled else [])


def grouped_matmul_elements(cfg: ModelConfig, w: Widths, experts_train: bool) -> int:
    """Elements of the masked [E, N K, width] copies a mixture's grouped matmul makes in one layer's backward where
    `lax.ragged_dot` becomes a dense matmul per expert over every row (TPU without megablox): the widest one for the
    inputs' gradient; the inputs' and the outputs' gradient's, twice, when the experts train (measured on XLA:CPU
    within 10% of the step, 4 and 8 experts of 64 to 704 units, while CPU ran ragged_dot)."""
    if not cfg.num_experts:
        return 0
    rows = w.b * w.T * cfg.experts_per_token
    widths = 2 * (w.D + 2 * cfg.expert_size) if experts_train else max(w.D, 2 * cfg.expert_size)
    return cfg.num_experts * rows * widths


def weight_gradient_elements(policy: str, w: Widths) -> int:
    """Elements of the transposed inputs XLA:CPU's backward of one layer makes for its weights' gradients
    (`WEIGHT_GRADIENT_COPIES`), where the base trains."""
    return int(WEIGHT_GRADIENT_COPIES[policy] * w.b * w.Tm * w.F)


def adapter_backward_elements(cfg: ModelConfig, method, w: Widths) -> int:
    """Extra [b, T, F] elements one layer's backward holds for each MLP module with a LoRA branch: the branch's own
    gradient beside the frozen matmul's, about 1.6 of them a module (measured on XLA:CPU; attention modules' branches
    are narrow enough to hide in BACKWARD_SHARE); folded into its base product (`Widths.fused_low_rank`), about 1.0
    (fitted: 0.1 of them on 2 x 128-token rows to 2 on a 16k-token row's tiles, XLA:CPU)."""
    if not method_unit(method).costs.low_rank:
        return 0
    adapted = adapted_modules(method, cfg.layer_stacks())
    mlp_adapted = sum(width * (m in adapted) for m, width in (("gate_proj", 1), ("up_proj", 1), ("gate_up_proj", 2),
                                                              ("down_proj", 1)))
    return int((1.0 if w.fused_low_rank else 1.6) * mlp_adapted * w.b * w.Tm * w.F)


def attention_block(w: Widths) -> tuple[int, int, int, int]:
    """The shape of one block of one layer's attention scores on one device: [b, H, bq, bk]."""
    return w.b, w.heads, block_size(w.T), block_size(w.S)


def context_attention_bytes(w: Widths, itemsize: int, nbytes) -> int:
    """Bytes one layer's attention backward holds to cross a context axis, beside the blockwise kernel's own (its
    float32 key and value gradients over the S keys it attends: `activation_bytes`). "ring": the key and value
    block passed on beside the one attended, with the float32 gradient blocks passed along with it, and the
    queries' float32 gradient carried round the ring; "all_gather": the layer's keys and values gathered from every
    device (each device's keys after the forward are gathered again in the backward). Measured on XLA:CPU within
    a few percent of a layer's working set (tests/test_context_planner.py)."""
    if w.context == 1:
        return 0
    if w.strategy == "all_gather":
        return 2 * nbytes((w.b, w.kv_heads, w.S, w.head_dim), itemsize)
    block = (w.b, w.kv_heads, w.T, w.head_dim)
    return 2 * nbytes(block, itemsize) + 2 * nbytes(block, 4) + nbytes((w.b, w.heads, w.T, w.head_dim), 4)


def live_block_fraction(T: int, prefix: int, blocks=None) -> float:
    """The share of a causal attention's query x key blocks the kernel computes (the rest the mask removes
    entirely): all of them for one block, about half for many. blocks(T, S) -> (query, key) block sizes: a fused
    kernel's (`KernelCosts.blocks`); None: the blockwise kernel's."""
    S = prefix + T
    bq, bk = blocks(T, S) if blocks is not None else (block_size(T), block_size(S))
    nq, nk = -(-T // bq), -(-S // bk)
    live = sum(min(nk, -(-(prefix + (i + 1) * bq) // bk)) for i in range(nq))
    return live / (nq * nk)


def _linear_module_elements(cfg: ModelConfig) -> int:
    """Elements of every layer's linear modules' kernels (not a mixture's experts or router), over the layers
    holding each."""
    return sum(d_in * d_out * len(cfg.module_layers(name)) for name, (d_in, d_out, _) in linear_shapes(cfg).items())


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights each token multiplies through (2 FLOPs each in the forward): every linear layer (of a mixture, the
    router and the K experts it routes to, in the layers that hold one) and the head."""
    D, L = cfg.hidden_size, cfg.num_layers
    routed = 3 * D * cfg.experts_per_token * cfg.expert_size if cfg.num_experts else 0
    per_layer_input = 3 * D * cfg.per_layer_input_size * L  # Gemma 4's: the projection to every layer's, each's branch
    mixtures = len(cfg.mixture_layers) * (routed + D * (cfg.num_experts + bool(cfg.shared_expert_size)))
    return _linear_module_elements(cfg) + mixtures + per_layer_input + D * cfg.vocab_size


def expert_kernel_elements(cfg: ModelConfig) -> int:
    """Elements of one layer's expert stacks (gate, up and down of every expert)."""
    return cfg.num_experts * 3 * cfg.hidden_size * cfg.expert_size


def kernel_elements_per_layer(cfg: ModelConfig) -> int:
    """Elements of one layer's linear kernels, every expert's included (Qwen3.5's: the mean over its two kinds)."""
    return (_linear_module_elements(cfg) // cfg.num_layers + expert_kernel_elements(cfg)
            + cfg.hidden_size * cfg.num_experts)


def attention_flops_per_row(cfg: ModelConfig, seq_len: int, prefix: int, blocks=None) -> int:
    """Forward FLOPs of q k^T and probs v for one row of `seq_len` tokens, all layers, over the blocks the causal
    mask leaves live (`live_block_fraction`, of a fused kernel's blocks or the blockwise kernel's)."""
    widths = len(cfg.attention_layers) * cfg.head_dim + len(cfg.global_layers) * (cfg.global_head_dim - cfg.head_dim)
    dense = widths * 4 * cfg.num_heads * seq_len * (seq_len + prefix)  # (Gemma 4's full layers of their own width)
    return int(dense * live_block_fraction(seq_len, prefix, blocks)) + linear_attention_flops_per_row(cfg, seq_len)


def linear_attention_flops_per_row(cfg: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs of the chunked delta rule for one row, all Gated DeltaNet layers: per token and value head, its
    chunk's scores and system (2 x C x dk each), their products with the values and the two solves (C x (dv + dk)
    each, the solves' half triangle counted whole), and the state's read and update (3 x dk x dv)."""
    C, dk, dv = LINEAR_CHUNK, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per_token = 2 * cfg.linear_num_value_heads * (2 * C * dk + 2 * C * (dk + dv) + 3 * dk * dv)
    return len(cfg.linear_attention_layers) * seq_len * per_token


@dataclass(frozen=True)
class ActivationBytes:
    """Per device: every layer's saved activations, one layer's attention workspace (a block of scores and their
    gradient, the kernel's accumulators), the rest of that layer's backward workspace (of which `expert_streams`
    a frozen mixture's group streams, `EXPERT_STREAMS`), one chunk's [b, c, V] float32 logits buffer and all logits
    buffers alive at the loss."""

    saved: int
    attention: int
    workspace: int
    logits_one: int
    logits: int
    expert_streams: int = 0


def offloaded(acts: ActivationBytes, layers: int) -> ActivationBytes:
    """`acts` of remat "full" on the device under remat "offload": every layer's input is in host memory (the
    compiler's host temporaries: the whole [L, b, T, D] stack), `OFFLOAD_LAYERS_ON_DEVICE` of them on the device."""
    return replace(acts, saved=OFFLOAD_LAYERS_ON_DEVICE * acts.saved // layers)


def _union(*kinds: list) -> list:
    """The tensors of several kinds' lists, each (shape, float32) as many times as the most any kind holds."""
    counts: dict = {}
    for tensors in kinds:
        for key, n in Counter((shape, f32) for _, shape, f32 in tensors).items():
            counts[key] = max(counts.get(key, 0), n)
    return [("union", shape, f32) for (shape, f32), n in counts.items() for _ in range(n)]


def activation_bytes(cfg: ModelConfig, method, policy: str, w: Widths, itemsize: int, nbytes,
                     logits_copies: int = 2, global_rows: int | None = None, loose_nbytes=None,
                     workspace_itemsize: int | None = None) -> ActivationBytes:
    """The activation terms for `policy`, with `itemsize` bytes per activation value, `nbytes(shape, itemsize)` the
    bytes an array of that shape occupies on the device (tiles on TPU), and `logits_copies` [b, T, V] float32
    chunk buffers alive at the loss (the objective's `Objective.logits_copies`, measured on XLA:CPU; a chunk holds
    `head.chunk_length` tokens a row, set by the `global_rows` of the whole micro-batch (default b), all T of a
    short sequence). `loose_nbytes`: the bytes of an array inside one layer's backward, where the compiler lays it
    out freely (TPU: a [b, T, H, 64] array untiled along its 64), if not `nbytes`; `workspace_itemsize`: bytes per
    value there, if not `itemsize` (XLA:CPU widens 16-bit values inside a layer; the scan's stacks keep their
    bits, `models/remat.py`)."""
    size = lambda tensors, nbytes=nbytes, itemsize=itemsize: sum(nbytes(shape, 4 if f32 else itemsize)
                                                                 for _, shape, f32 in tensors)
    block = attention_block(w)
    loops = block_size(w.T) < w.T or block_size(w.S) < w.S
    copies = (ATTENTION_COPIES_F32 if loops else ONE_BLOCK_COPIES_F32)[policy]
    attention = copies * nbytes(block, 4) + nbytes(block, itemsize)
    if loops:  # the accumulators the loops carry
        attention += nbytes((w.b, w.heads, w.T, w.head_dim), 4) + 2 * nbytes((w.b, w.kv_heads, w.S, w.head_dim), 4)
    attention += context_attention_bytes(w, itemsize, nbytes)
    untiled = replace(w, mlp_tile=0)
    layer = [(name, (shape[0], w.Tm, *shape[2:]) if name in mlp_terms(cfg) else shape, f32)  # a tile's MLP terms
             for name, shape, f32 in saved_tensors(cfg, method, "none", untiled)]
    frozen_experts = bool(cfg.num_experts) and not _trains_input(method, "experts", {})
    streams = size([t for t in layer if frozen_experts and t[0] in EXPERT_STREAMS], loose_nbytes or nbytes,
                   workspace_itemsize or itemsize)
    workspace = int(BACKWARD_SHARE[policy] * (size(layer, loose_nbytes or nbytes, workspace_itemsize or itemsize)
                                              - streams)) + streams
    workspace += adapter_backward_elements(cfg, method, w) * (workspace_itemsize or itemsize)
    chunk = chunk_length(global_rows or w.b, w.T, cfg.vocab_size)
    logits_one = nbytes((w.b, chunk, w.V), 4)
    if w.context > 1 and chunk >= w.T:  # one tile a device: three chunk buffers at least (measured on XLA:CPU)
        logits_copies = max(logits_copies, 3)
    # the attention kernel's residuals; a remat'd layer recomputes them in its workspace
    kernel_saved = [("attention output", (w.b, w.T, w.heads, w.head_dim), False),
                    ("attention log-sum-exp", (w.b, w.T, w.heads), True)] * (policy == "none")
    saved = saved_tensors(cfg, method, policy, w) + kernel_saved
    saved_bytes = len(cfg.attention_layers) * size(saved)
    if cfg.linear_attention_layers:  # a layer's step switches between the kinds: each keeps its own workspace
        linear = linear_layer_saved(cfg, method, "none", untiled)
        linear_workspace = int(BACKWARD_SHARE[policy] * size(linear, loose_nbytes or nbytes,
                                                             workspace_itemsize or itemsize))
        workspace = linear_workspace + (workspace if cfg.attention_layers else 0)
        linear_saved = size(linear_layer_saved(cfg, method, policy, w))
        if policy == "none" and cfg.attention_layers:  # the switch keeps both kinds' residuals every layer
            saved_bytes = cfg.num_layers * (saved_bytes // len(cfg.attention_layers) + linear_saved)
        else:
            saved_bytes += len(cfg.linear_attention_layers) * linear_saved
    if cfg.dense_layers:  # Maverick's dense MLP layers: the switch's other kind
        dense_cfg = cfg.replace(num_experts=0, dense_layers=(), shared_expert_size=0)
        w_dense = replace(w, F=w.F * cfg.intermediate_size // mlp_width(cfg), megablox=False, expert_rows=1)
        dense = activation_bytes(dense_cfg, method, policy, w_dense, itemsize, nbytes, logits_copies, global_rows,
                                 loose_nbytes, workspace_itemsize)
        dense_saved = saved_tensors(dense_cfg, method, policy, w_dense) + kernel_saved
        if policy == "none":  # each layer keeps both kinds' residuals, those of one shape and type shared (jax's
            saved_bytes = cfg.num_layers * size(_union(saved, dense_saved))  # cond merges branch residuals so)
        else:
            saved_bytes = len(cfg.mixture_layers) * size(saved) + len(cfg.dense_layers) * size(dense_saved)
        if dense.workspace > workspace:
            workspace, streams = dense.workspace, dense.expert_streams
        # both kinds attend, each switch branch's backward with attention blocks of its own: XLA:CPU held 1.7x
        # (Maverick) and 2.3x (DeepSeek-V3) the blocks of the layers without the switch (full fine-tuning, 256 tokens)
        attention = attention * 3 // 2
    if cfg.global_head_dim:  # Gemma 4: the switch between its kinds (widths of attention and MLP), as Maverick's
        kinds = gemma4_kinds(cfg, w)
        per_kind = {kind: activation_bytes(view.replace(global_head_dim=0, shared_kv_layers=0), method, policy, kw,
                                           itemsize, nbytes, logits_copies, global_rows, loose_nbytes,
                                           workspace_itemsize) for kind, (view, kw, _) in kinds.items()}
        saved_sets = {kind: saved_tensors(view, method, policy, kw) + [
            ("attention output", (kw.b, kw.T, kw.heads, kw.head_dim), False),
            ("attention log-sum-exp", (kw.b, kw.T, kw.heads), True)] * (policy == "none")
            for kind, (view, kw, _) in kinds.items()}
        P = cfg.per_layer_input_size
        per_layer_input = nbytes((w.b, w.T, P), itemsize) if P else 0  # its slice of the [L, b, T, P] inputs
        if policy == "none":  # each norm of the residual stream keeps its float32 input, and where its weight trains
            # its float32 output (XLA:CPU): the sandwich's four, the mixture's three and its router's, PLE's (two of
            # them counted in saved_tensors)
            norms = 4 + 4 * cfg.experts_beside_mlp + bool(P)
            kept = norms * (1 + method_unit(method).trains_base) - 2
            per_layer_input += kept * nbytes((w.b, w.T, w.D), 4)
        if policy == "none" and len(kinds) > 1:
            saved_bytes = cfg.num_layers * (size(_union(*saved_sets.values())) + per_layer_input)
        else:
            saved_bytes = sum(n * (size(saved_sets[kind]) + per_layer_input) for kind, (_, _, n) in kinds.items())
        widest = max(per_kind.values(), key=lambda a: a.workspace)
        workspace, streams = widest.workspace, widest.expert_streams
        attention = max(a.attention for a in per_kind.values()) * (3 if len(kinds) > 1 else 2) // 2
    if cfg.final_logit_softcap:
        logits_copies += SOFTCAP_LOGITS_COPIES
    return ActivationBytes(saved_bytes, attention, workspace, logits_one, int(logits_copies * logits_one), streams)
