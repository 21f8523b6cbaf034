"""Reward models: a scalar head on the decoder, read at each sequence's last completion token, trained with the
Bradley-Terry loss on preference pairs (Ouyang et al. 2022). Pairs come as in `preference.py`: [2B, T] rows,
chosen first; the last real input position of a row holds its last completion token.

On disk a reward model is what transformers' `*ForSequenceClassification` reads: config.json with that
architecture, num_labels 1 and pad_token_id set; model.safetensors with the decoder's tensors (no lm_head) and
`score.weight` [1, hidden]. transformers reads the score at the last token that is not padding, so the reward of
(prompt, completion) is its score on the ids prompt + completion (no EOS), the same number jaxtune computes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import save_file

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.methods.transform import combine
from jaxtune.models.hf_config import config_from_hf, config_to_hf, model_dir, read_json
from jaxtune.models.hf_weights import (
    DTYPES,
    SINGLE_FILE,
    TOKENIZER_FILES,
    hf_state_dict,
    hf_tensor_name,
    open_checkpoint,
)
from jaxtune.models.llama import decoder
from jaxtune.models.params import ParamSpec, param_specs
from jaxtune.objectives import bradley_terry_loss
from jaxtune.train.update import objective_step

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


def _pair_terms(params, batch, cfg, method, options, key=None):
    scores = reward_scores(params, batch, cfg, method, options, key)
    B = scores.shape[0] // 2
    real = (jnp.sum(batch["loss_mask"][:B], axis=-1) > 0).astype(jnp.float32)
    losses = bradley_terry_loss(scores[:B], scores[B:])
    accuracy = (scores[:B] > scores[B:]).astype(jnp.float32)
    return jnp.sum(losses * real), (jnp.sum(real), {"accuracy": jnp.sum(accuracy * real),
                                                      "margin": jnp.sum((scores[:B] - scores[B:]) * real)})


def make_reward_step(cfg: ModelConfig, method: MethodConfig, options: ForwardOptions,
                     optimizer: optax.GradientTransformation, schedule: optax.Schedule):
    """The jitted `step(state, frozen, batch[A, 2B, T]) -> (state, metrics)`, state donated."""

    def pair_terms(trainable, frozen, micro, key):
        return _pair_terms(combine(trainable, frozen), micro, cfg, method, options, key)

    return objective_step(pair_terms, method, optimizer, schedule)


def make_reward_eval(cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions):
    """Jitted `(params, batch) -> {"loss", "pairs", "accuracy", "margin"}` sums over a pair batch."""

    def evaluate(params, batch):
        loss, (pairs, sums) = _pair_terms(params, batch, cfg, method, options)
        return {"loss": loss, "pairs": pairs, **sums}

    return jax.jit(evaluate)


def is_reward_model(directory: str | Path) -> bool:
    """Whether `directory`'s config.json names a `*ForSequenceClassification` architecture."""
    archs = read_json(model_dir(directory) / "config.json").get("architectures") or []
    return any(a.endswith(SEQUENCE_CLASSIFICATION) for a in archs)


def save_reward_model(directory: str | Path, cfg: ModelConfig, params: dict, tokenizer_from: str | Path | None = None,
                      dtype: str | None = None) -> Path:
    """Write `params` (a base tree, adapters merged, with `score`) as an HF sequence-classification directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np_dtype = DTYPES[dtype] if dtype else None
    state = hf_state_dict({k: v for k, v in params.items() if k not in ("lm_head", "score")}, cfg, np_dtype)
    score = np.asarray(params["score"]["kernel"], np.float32)[None, :]
    state["score.weight"] = score.astype(np_dtype) if np_dtype else score
    dtype_name = dtype or str(state["model.embed_tokens.weight"].dtype)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id[0]
    hf = {**config_to_hf(cfg, dtype_name), "pad_token_id": pad, "num_labels": 1, "id2label": {"0": "LABEL_0"},
          "label2id": {"LABEL_0": 0},
          "architectures": [cfg.architecture.replace("ForCausalLM", SEQUENCE_CLASSIFICATION)]}
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(state, str(directory / SINGLE_FILE), metadata={"format": "pt"})
    for name in TOKENIZER_FILES if tokenizer_from is not None else ():
        if (Path(tokenizer_from) / name).is_file():
            shutil.copyfile(Path(tokenizer_from) / name, directory / name)
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
    tensors = open_checkpoint(directory)

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise JaxtuneError(f"{directory}: tensor {name} is missing from the checkpoint")
        value = tensors[name][0].get_tensor(name)
        if value.shape != shape:
            raise JaxtuneError(f"{tensors[name][1]}: tensor {name} has shape {value.shape}, expected {shape}")
        return value

    def leaf(path, spec: ParamSpec) -> np.ndarray:
        keys = tuple(k.key for k in path)
        kernel = keys[-1] == "kernel"  # stored [out, in]

        def one(name: str, shape: tuple[int, ...]) -> np.ndarray:
            value = read(name, shape[::-1] if kernel else shape)
            return value.T if kernel else value

        if keys[0] != "layers":
            return one(hf_tensor_name(keys, None), spec.shape)
        return np.stack([one(hf_tensor_name(keys, i), spec.shape[1:]) for i in range(cfg.num_layers)])

    params = jax.tree_util.tree_map_with_path(leaf, param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))
    params["score"] = {"kernel": read("score.weight", (1, cfg.hidden_size))[0]}
    dtype = np.dtype(dtype) if dtype is not None else params["embed_tokens"].dtype
    return cfg, jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
