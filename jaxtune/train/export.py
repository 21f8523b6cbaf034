"""What a finished run leaves for users: a PEFT adapter directory, or a Hugging Face model for a full fine-tune."""

from __future__ import annotations

from pathlib import Path

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.methods.peft import save_peft_adapter
from jaxtune.models.hf_weights import save_model
from jaxtune.run_config import RunConfig


def export_result(run_dir: Path, config: RunConfig, cfg: ModelConfig, params: dict, method: MethodConfig) -> Path:
    """run_dir/adapter, or for a full fine-tune run_dir/model: an HF directory with the base's tokenizer, in
    [model] dtype (the float32 master weights when it is "auto")."""
    if method.kind == "full":
        dtype = None if config.model.dtype == "auto" else config.model.dtype
        return save_model(run_dir / "model", cfg, params, dtype=dtype, tokenizer_from=config.model.path)
    return save_peft_adapter(run_dir / "adapter", params, cfg, method, base_model=str(Path(config.model.path)))
