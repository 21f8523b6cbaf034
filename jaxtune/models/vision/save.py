"""A vision-language model written whole as a Hugging Face directory (`save_vision_language_model`): the text model's
tensors (`hf_weights.tensor_entries`, a merged adapter included) and the image side's, each under the name the
source checkpoint stores it by (whichever layout transformers saved: `language_model.model.*` or
`model.language_model.*`, `vision_tower.*`), beside the source's config.json and processor files, so transformers'
`Gemma3ForConditionalGeneration.from_pretrained` loads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.io.safetensors import CheckpointReader, write_weights
from jaxtune.models.hf_config import model_dir
from jaxtune.models.hf_weights import STORED_DTYPES, canonical_name, tensor_entries
from jaxtune.models.vision.family import VisionFamily

# what a vision-language directory holds beside its weights and tokenizer
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json", "chat_template.jinja",
                   "generation_config.json")


def save_vision_language_model(directory: str | Path, source: str | Path, cfg: ModelConfig, params: dict,
                               family: VisionFamily, config, dtype: str | None = None, tensor=None,
                               max_shard_bytes: int = 2 * 2**30) -> Path:
    """Write the text params (`params` less `params["vision"]`; `tensor` as `tensor_entries` takes it: a merged
    adapter) and the image side `params["vision"]` as the vision-language directory `source` stores them, with its
    config.json (its dtype set to the one written) and processor files. The tokenizer is the caller's to copy."""
    directory, source = Path(directory), model_dir(source)
    stored = STORED_DTYPES[dtype] if dtype else None
    text = {k: v for k, v in params.items() if k != "vision"}
    entries = tensor_entries(text, cfg, stored, tensor=tensor) + family.tensor_entries(params["vision"], config,
                                                                                        stored)
    with CheckpointReader(source, canonical_name) as reader:
        def name(canonical: str) -> str:
            if canonical in reader:
                return reader.stored_name(canonical)
            if canonical == "lm_head.weight":  # a head trained apart from a tied embedding
                return canonical
            raise JaxtuneError(f"{source}: tensor {canonical} is not in the vision-language checkpoint")

        entries = [(name(canonical_name(n)), *rest) for n, *rest in entries]  # Llama 4's text: hub names
    directory.mkdir(parents=True, exist_ok=True)
    hf = json.loads((source / "config.json").read_text())
    written = str(entries[0][2])
    hf["dtype"] = hf["torch_dtype"] = written
    if "lm_head" in params and cfg.tie_word_embeddings:
        hf["tie_word_embeddings"] = False
        hf.setdefault("text_config", {})["tie_word_embeddings"] = False
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for file in PROCESSOR_FILES:
        if (source / file).is_file():
            shutil.copyfile(source / file, directory / file)
    write_weights(directory, entries, max_shard_bytes)
    return directory
