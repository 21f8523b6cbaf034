"""Hugging Face `config.json` <-> `ModelConfig`, for the architectures jaxtune computes exactly."""

from __future__ import annotations

import json
from pathlib import Path

from jaxtune.config import ARCHITECTURES, ModelConfig, RopeScaling
from jaxtune.errors import JaxtuneError

MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}


def read_json(path: Path) -> dict:
    """A JSON file as a dict, with errors that name the file."""
    if not path.is_file():
        raise JaxtuneError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise JaxtuneError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None


def model_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise JaxtuneError(f"{path}: model directory not found")
    if not path.is_dir():
        raise JaxtuneError(f"{path}: expected a model directory (config.json + *.safetensors), found a file")
    return path


def _rope(hf: dict, where: str) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); earlier versions `rope_scaling`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise JaxtuneError(f"{where}: partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))),
        )
    raise JaxtuneError(f"{where}: rope type {kind!r} is not supported (supported: default, linear, llama3)")


def _sliding_windows(hf: dict, arch: str, num_layers: int) -> tuple[int, ...]:
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM":
        return (int(window or 0),) * num_layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not hf.get("use_sliding_window", False) or not window:
            return (0,) * num_layers
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(num_layers)
        ]
        return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    return (0,) * num_layers


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Translate a transformers config dict; `where` names the file in error messages."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        found = ", ".join(archs) or f"model_type={hf.get('model_type')!r}"
        raise JaxtuneError(f"{where}: unsupported architecture {found}; supported: {', '.join(ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise JaxtuneError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    try:
        heads = int(hf["num_attention_heads"])
        layers = int(hf["num_hidden_layers"])
        theta, scaling = _rope(hf, where)
        eos = hf.get("eos_token_id")
        qwen = arch == "Qwen2ForCausalLM"
        return ModelConfig(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qwen or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            o_bias=not qwen and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(hf, arch, layers),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            pad_token_id=hf.get("pad_token_id"),
        )
    except KeyError as e:
        raise JaxtuneError(f"{where}: missing key {e.args[0]!r}") from None
    except ValueError as e:
        raise JaxtuneError(f"{where}: {e}") from None


def load_config(path: str | Path) -> ModelConfig:
    """`ModelConfig` of the Hugging Face model directory `path`."""
    path = model_dir(path) / "config.json"
    return config_from_hf(read_json(path), str(path))


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """A config.json dict that transformers reads back as the same architecture."""
    windows = set(cfg.sliding_windows) - {0}
    hf = {
        "architectures": [cfg.architecture],
        "model_type": MODEL_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope_theta,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else (cfg.eos_token_id or [None])[0],
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                           original_max_position_embeddings=s.original_max_position_embeddings)
        hf["rope_scaling"] = scaling
        hf["rope_parameters"] = {**scaling, "rope_theta": cfg.rope_theta}
    if cfg.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        if cfg.qkv_bias != cfg.o_bias:
            raise JaxtuneError(f"{cfg.architecture} has one attention_bias flag for q, k, v and o alike")
        hf["attention_bias"] = cfg.qkv_bias
    if cfg.architecture == "LlamaForCausalLM":
        hf["mlp_bias"] = cfg.mlp_bias
    elif cfg.architecture == "MistralForCausalLM":
        hf["sliding_window"] = max(windows) if windows else None
    else:
        hf["use_sliding_window"] = bool(windows)
        hf["sliding_window"] = max(windows) if windows else None
        hf["layer_types"] = ["sliding_attention" if w else "full_attention" for w in cfg.sliding_windows]
        hf["max_window_layers"] = next((i for i, w in enumerate(cfg.sliding_windows) if w), cfg.num_layers)
    return hf
