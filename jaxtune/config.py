"""Frozen, hashable configs. They are static arguments under `jax.jit`, so every field is a scalar or tuple."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as in transformers' `rope_parameters` (`rope_scaling` before v5).

    kind: "linear" divides every frequency by `factor`; "llama3" divides only the low frequencies and
    interpolates the band between (Llama 3.1 report, section 3.3 of transformers' `_compute_llama3_parameters`).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder.

    `sliding_windows` has one entry per layer: 0 for full causal attention, w > 0 to let a query at index i see
    keys at indices j with i - w < j <= i (Mistral; Qwen2 layers marked "sliding_attention").
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    architecture: str = "LlamaForCausalLM"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[int, ...] = ()
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (0,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def tiny_config(**overrides) -> ModelConfig:
    """A tiny Llama shape (about 0.2M parameters) for tests, examples and the demo."""
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, max_position_embeddings=512)
    base.update(overrides)
    return ModelConfig(**base)


METHOD_KINDS = ("full", "lora", "qlora", "ia3", "prefix", "adapter")
LINEAR_MODULE_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = {"lora": ("q_proj", "v_proj"), "qlora": ("q_proj", "v_proj"), "ia3": ("k_proj", "v_proj", "down_proj")}


@dataclass(frozen=True)
class MethodConfig:
    """A fine-tuning method and its hyper-parameters.

    kind: full | lora | qlora | ia3 | prefix | adapter.
    target_modules: Hugging Face module names, or ("all-linear",); default q_proj v_proj (k_proj v_proj down_proj for
    IA3, which scales the input of MLP modules and the output of attention modules, as PEFT does).
    LoRA scaling is alpha / rank, or alpha / sqrt(rank) with `rslora` (Kalajdzievski 2023); `dora` adds DoRA's
    magnitude vector (Liu et al. 2024). QLoRA keeps every linear base weight frozen in `bits` (4: NF4, 8: int8), with
    `double_quant` compressing the NF4 block scales. Prefix tuning learns `num_virtual_tokens` keys and values per
    layer; bottleneck adapters of width `adapter_size` follow attention and MLP (Houlsby et al. 2019).
    """

    kind: str = "lora"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    rslora: bool = False
    dora: bool = False
    bits: int = 4
    double_quant: bool = True
    num_virtual_tokens: int = 16
    adapter_size: int = 64

    def __post_init__(self):
        if self.kind not in METHOD_KINDS:
            raise ValueError(f"unknown method kind {self.kind!r}; choose one of {', '.join(METHOD_KINDS)}")
        targets = tuple(self.target_modules) or DEFAULT_TARGETS.get(self.kind, ())
        if targets in (("all-linear",), ("all_linear",)):
            targets = LINEAR_MODULE_NAMES
        unknown = [t for t in targets if t not in LINEAR_MODULE_NAMES]
        if unknown:
            raise ValueError(f"unknown target module {unknown[0]!r}; valid names: {', '.join(LINEAR_MODULE_NAMES)}"
                             " or all-linear")
        object.__setattr__(self, "target_modules", tuple(t for t in LINEAR_MODULE_NAMES if t in targets))
        if self.kind in ("lora", "qlora") and self.rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}")
        if self.kind == "qlora" and self.bits not in (4, 8):
            raise ValueError(f"QLoRA bits must be 4 or 8, got {self.bits}")
        if self.kind == "prefix" and self.num_virtual_tokens <= 0:
            raise ValueError(f"num_virtual_tokens must be positive, got {self.num_virtual_tokens}")
        if self.kind == "adapter" and self.adapter_size <= 0:
            raise ValueError(f"adapter_size must be positive, got {self.adapter_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def lora_scale(self) -> float:
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)
