"""Reward models: a scalar head on the decoder, read at each sequence's last real token (`objectives/reward.py`
trains it with the Bradley-Terry loss).

On disk a reward model is what transformers' `*ForSequenceClassification` reads: config.json with that
architecture, num_labels 1 and pad_token_id set; model.safetensors with the decoder's tensors (no lm_head) and
`score.weight` [1, hidden]. transformers reads the score at the last token that is not padding, so the reward of
(prompt, completion) is its score on the ids prompt + completion (no EOS), the same number jaxtune computes.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.gguf import is_gguf
from jaxtune.models.hf_config import config_from_hf, config_to_hf, model_dir, read_json
from jaxtune.models.hf_weights import DTYPES, check_tensors, copy_tokenizer, expected_tensors, read_leaf, tensor_entries
from jaxtune.models.llama import decoder
from jaxtune.models.params import ParamSpec, param_specs
from jaxtune.models.safetensors_io import CheckpointReader, write_weights

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


def save_reward_model(directory: str | Path, cfg: ModelConfig, params: dict, tokenizer_from: str | Path | None = None,
                      dtype: str | None = None, tensor=None) -> Path:
    """Write `params` (a base tree with `score`) as an HF sequence-classification directory, tensor by tensor;
    `tensor` as for `hf_weights.tensor_entries` (a LoRA reward model merges its adapters there, layer by layer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(DTYPES[dtype]) if dtype else None
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
    copy_tokenizer(tokenizer_from, directory)
    return directory


def load_reward_model(directory: str | Path, dtype=None) -> tuple[ModelConfig, dict]:
    """(config, params with `score`) of a directory `save_reward_model` (or transformers) wrote.

    The config is the causal architecture's with tied embeddings: a reward model has no LM head.
    """
    directory = model_dir(directory)
    where = directory / "config.json"
    hf = read_json(where)
    arch = next((a for a in hf.get("architectures") or [] if a.endswith(SEQUENCE_CLASSIFICATION)), None)
    if arch is None or hf.get("num_labels", len(hf.get("id2label") or {0: 0})) != 1:
        raise JaxtuneError(f"{where}: not a reward model (a *{SEQUENCE_CLASSIFICATION} with num_labels 1)")
    cfg = config_from_hf({**hf, "architectures": [arch.replace(SEQUENCE_CLASSIFICATION, "ForCausalLM")],
                          "tie_word_embeddings": True}, str(where))
    specs = param_specs(cfg)
    with CheckpointReader(directory) as reader:
        check_tensors(reader, directory, cfg, {**expected_tensors(cfg), "score.weight": (1, cfg.hidden_size)})
        dtype = np.dtype(dtype if dtype is not None else reader.dtype("model.embed_tokens.weight"))
        params = jax.tree_util.tree_map_with_path(
            lambda path, spec: jnp.asarray(read_leaf(reader, tuple(k.key for k in path), spec, dtype, cfg)), specs,
            is_leaf=lambda x: isinstance(x, ParamSpec))
        params["score"] = {"kernel": jnp.asarray(reader.read("score.weight")[0].astype(dtype))}
    return cfg, params
