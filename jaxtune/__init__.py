"""jaxtune: plan, run and export fine-tuning of decoder language models in JAX.

The public API, one name a line; everything else is internal. Importing `jaxtune` loads none of it: each name is
imported the first time it is used (`import jaxtune` takes milliseconds, and the CLI loads only what a command
runs).
"""

from __future__ import annotations

import importlib

PUBLIC = {  # name -> the module that defines it
    "ForwardOptions": "jaxtune.config",
    "ImageProcessingConfig": "jaxtune.config",
    "MeshConfig": "jaxtune.config",
    "MethodConfig": "jaxtune.config",
    "ModelConfig": "jaxtune.config",
    "Remat": "jaxtune.config",
    "RopeScaling": "jaxtune.config",
    "SamplingConfig": "jaxtune.config",
    "VisionLanguageConfig": "jaxtune.config",
    "TrainPlan": "jaxtune.config.plan",
    "Tokenizer": "jaxtune.data.tokenizer",
    "copy_tokenizer": "jaxtune.data.tokenizer",
    "load_tokenizer": "jaxtune.data.tokenizer",
    "Environment": "jaxtune.environments.base",
    "StepResult": "jaxtune.environments.base",
    "load_environment": "jaxtune.environments.base",
    "register_environment": "jaxtune.environments.base",
    "EpisodeTokens": "jaxtune.environments.episode",
    "render_episode": "jaxtune.environments.episode",
    "rollout": "jaxtune.environments.episode_batch",
    "ToolRunner": "jaxtune.environments.runner",
    "json_schema": "jaxtune.environments.schema",
    "parse_tool_calls": "jaxtune.environments.tool_calls",
    "ToolEnvironment": "jaxtune.environments.tool_env",
    "ConfigError": "jaxtune.errors",
    "JaxtuneError": "jaxtune.errors",
    "generate": "jaxtune.generation",
    "generate_text": "jaxtune.generation",
    "ImageGenerator": "jaxtune.image_generation",
    "generate_batch_with_images": "jaxtune.image_generation",
    "generate_texts_with_images": "jaxtune.image_generation",
    "generate_with_images": "jaxtune.image_generation",
    "load_image_generator": "jaxtune.image_generation",
    "prompt_ids": "jaxtune.image_generation",
    "method_config": "jaxtune.methods",
    "AdapterConfig": "jaxtune.methods.adapter",
    "FullConfig": "jaxtune.methods.full",
    "IA3Config": "jaxtune.methods.ia3",
    "LoRAConfig": "jaxtune.methods.lora",
    "QLoRAConfig": "jaxtune.methods.lora",
    "lora_layout": "jaxtune.methods.lora",
    "merge": "jaxtune.methods.lora",
    "unmerge": "jaxtune.methods.lora",
    "load_peft_adapter": "jaxtune.methods.peft",
    "save_peft_adapter": "jaxtune.methods.peft",
    "PrefixConfig": "jaxtune.methods.prefix",
    "apply_method": "jaxtune.methods.transform",
    "combine": "jaxtune.methods.transform",
    "parameter_report": "jaxtune.methods.transform",
    "partition": "jaxtune.methods.transform",
    "trainable_mask": "jaxtune.methods.transform",
    "load_config": "jaxtune.models.hf_config",
    "save_model": "jaxtune.models.hf_weights",
    "decoder": "jaxtune.models.llama",
    "forward": "jaxtune.models.llama",
    "abstract_params": "jaxtune.models.params",
    "init_params": "jaxtune.models.params",
    "logical_axes": "jaxtune.models.params",
    "param_specs": "jaxtune.models.params",
    "dequantize": "jaxtune.models.quant",
    "quantize_int8": "jaxtune.models.quant",
    "quantize_nf4": "jaxtune.models.quant",
    "save_reward_model": "jaxtune.models.reward_model",
    "vision_language_forward": "jaxtune.models.vision.gemma3",
    "vision_language_prefill": "jaxtune.models.vision.gemma3",
    "pixel_values": "jaxtune.models.vision.image_processing",
    "read_image_processing": "jaxtune.models.vision.image_processing",
    "ClusterConfig": "jaxtune.parallel.distributed",
    "join_cluster": "jaxtune.parallel.distributed",
    "PagePool": "jaxtune.rollouts.engine",
    "sample_groups": "jaxtune.rollouts.engine",
    "RunConfig": "jaxtune.run_config",
    "load_run_config": "jaxtune.run_config",
    "load_model": "jaxtune.spine.model",
    "load_model_with_adapter": "jaxtune.spine.model",
    "load_reward_model": "jaxtune.spine.model",
    "load_vision_language_model": "jaxtune.spine.model",
    "StopStrings": "jaxtune.stop_strings",
    "evaluate_file": "jaxtune.train.evaluation",
    "evaluate_preference_file": "jaxtune.train.evaluation",
    "export_merged": "jaxtune.train.export",
    "fine_tune": "jaxtune.train.loop",
}
__all__ = list(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'jaxtune' has no attribute {name!r}")
    value = getattr(importlib.import_module(PUBLIC[name]), name)
    globals()[name] = value  # the next use finds it here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
