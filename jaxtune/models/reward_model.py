"""Reward models: a scalar head on the decoder (`add_reward_head`), read at each sequence's last real token
(`reward_scores`; `objectives/reward.py` trains it with the Bradley-Terry loss), saved and loaded as transformers'
`*ForSequenceClassification` (`save_reward_model`, `load_reward_model`).

On disk: config.json with that architecture, num_labels 1 and pad_token_id set; model.safetensors with the decoder's
tensors (no lm_head) and `score.weight` [1, hidden]. transformers reads the score at the last token that is not
padding, so the reward of (prompt, completion) is its score on the ids prompt + completion (no EOS), as here.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.io.gguf import is_gguf
from jaxtune.io.json import read_json
from jaxtune.io.safetensors import write_weights
from jaxtune.models.hf_config import config_from_hf, config_to_hf, model_dir
from jaxtune.models.hf_weights import STORED_DTYPES, tensor_entries
from jaxtune.models.llama import decoder

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def add_reward_head(params: dict, cfg: ModelConfig, key: jax.Array) -> dict:
    """`params` with `score.kernel` [D] ~ N(0, initializer_range), as transformers initialises `score.weight`."""
    kernel = cfg.initializer_range * jax.random.normal(key, (cfg.hidden_size,), jnp.float32)
    return {**params, "score": {"kernel": kernel}}


def reward_scores(params: dict, batch: dict, cfg: ModelConfig, method: MethodConfig | None,
                  options: ForwardOptions, dropout_key: jax.Array | None = None) -> jax.Array:
    """Scalar reward [rows] of each row, from the hidden state at its last real position; dropout_key: LoRA
    dropout in training."""
    hidden_BxTxD = decoder(params, batch["input_ids"], cfg, positions_BxT=batch["positions"],
                           segment_ids_BxT=batch["segment_ids"], method=method, options=options,
                           dropout_key=dropout_key)
    last_B = jnp.maximum(jnp.sum(batch["segment_ids"] > 0, axis=-1) - 1, 0)
    hidden_BxD = jnp.take_along_axis(hidden_BxTxD, last_B[:, None, None], axis=1)[:, 0]
    return hidden_BxD.astype(jnp.float32) @ params["score"]["kernel"].astype(jnp.float32)


def is_reward_model(directory: str | Path) -> bool:
    """Whether `directory`'s config.json names a `*ForSequenceClassification` architecture (a GGUF file: never)."""
    if is_gguf(directory):
        return False
    archs = read_json(model_dir(directory) / "config.json").get("architectures") or []
    return any(a.endswith(SEQUENCE_CLASSIFICATION) for a in archs)


def save_reward_model(directory: str | Path, cfg: ModelConfig, params: dict, dtype: str | None = None,
                      tensor=None) -> Path:
    """Write `params` (a base tree with `score`) as an HF sequence-classification directory, tensor by tensor;
    `tensor` as for `hf_weights.tensor_entries` (a LoRA reward model merges its adapters there, layer by layer).
    The tokenizer beside it is `data.tokenizer.copy_tokenizer`'s to write."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(STORED_DTYPES[dtype]) if dtype else None
    entries = tensor_entries(params, cfg, np_dtype, skip=("lm_head", "score"), tensor=tensor)
    score_dtype = np_dtype or np.dtype(params["embed_tokens"].dtype)
    entries.append(("score.weight", (1, cfg.hidden_size), score_dtype,
                    lambda: np.asarray(params["score"]["kernel"], np.float32)[None, :].astype(score_dtype)))
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id[0]
    hf = {**config_to_hf(cfg, dtype or str(entries[0][2])), "pad_token_id": pad, "num_labels": 1,
          "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
          "architectures": [cfg.architecture.replace("ForCausalLM", SEQUENCE_CLASSIFICATION)]}
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    write_weights(directory, entries)
    return directory


def reward_config(directory: str | Path) -> tuple[Path, ModelConfig]:
    """(directory, config) of a reward model directory: the causal architecture's config with tied embeddings (a
    reward model has no LM head); `spine.model.load_reward_model` reads its weights."""
    directory = model_dir(directory)
    where = directory / "config.json"
    hf = read_json(where)
    arch = next((a for a in hf.get("architectures") or [] if a.endswith(SEQUENCE_CLASSIFICATION)), None)
    if arch is None or hf.get("num_labels", len(hf.get("id2label") or {0: 0})) != 1:
        raise JaxtuneError(f"{where}: not a reward model (a *{SEQUENCE_CLASSIFICATION} with num_labels 1)")
    return directory, config_from_hf({**hf, "architectures": [arch.replace(SEQUENCE_CLASSIFICATION, "ForCausalLM")],
                                      "tie_word_embeddings": True}, str(where))

