"""A training run's configuration: small frozen dataclasses, one per TOML section, with dotted overrides.

    [model]   path, dtype, compute_dtype, remat
    [method]  MethodConfig: kind, rank, alpha, dropout, target_modules, rslora, dora, bits, double_quant, ...
    [data]    train, eval, eval_fraction, max_seq_len, pack, seed
    [train]   objective (sft | dpo | reward | grpo | distill), output_dir, epochs, max_steps, batch_size, ...
    [mesh]    MeshConfig: data, fsdp, tensor (device mesh sizes; -1 takes the rest)
    [offload] OffloadConfig: optimizer_state, frozen_params (host memory), moments_dtype
    [dpo]     PreferenceConfig: loss (sigmoid | ipo | hinge), beta, label_smoothing, reference, precompute_reference
    [grpo]    GRPOConfig: reward or reward_model, group_size, max_new_tokens, temperature, top_k, top_p, clip, kl_coef
    [distill] DistillConfig: teacher, alpha, temperature, reverse

Only the section of the chosen objective is read; the others keep their defaults (and are written out as such).

Every key must be a field: an unknown key is an error naming it and its section. `--set train.lr=1e-4`-style
overrides are parsed as TOML values (strings may go unquoted). The resolved config is written back as TOML.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from jaxtune.config import MethodConfig
from jaxtune.errors import ConfigError, JaxtuneError, check_choice, check_range
from jaxtune.models.llama import Remat
from jaxtune.parallel.mesh import MeshConfig
from jaxtune.parallel.offload import OffloadConfig
from jaxtune.train.distill import DistillConfig
from jaxtune.train.grpo import GRPOConfig
from jaxtune.train.preference import PreferenceConfig

OBJECTIVES = ("sft", "dpo", "reward", "grpo", "distill")
PARAM_DTYPES = ("float32", "bfloat16", "float16")  # of the frozen base
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelSection:
    """path: a Hugging Face model directory. dtype: of the frozen base ("auto": as stored). Trainable leaves are
    always float32 master weights; compute_dtype "bfloat16" gives mixed precision."""

    path: str = ""
    dtype: str = "auto"
    compute_dtype: str = "float32"
    remat: str = "none"

    def __post_init__(self):
        check_choice("dtype", self.dtype, ("auto",) + PARAM_DTYPES)
        check_choice("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        Remat(self.remat)


@dataclass(frozen=True)
class DataConfig:
    """train/eval: JSONL files. Without an eval file, `eval_fraction` of train is held out (by `seed`)."""

    train: str = ""
    eval: str = ""
    eval_fraction: float = 0.1
    max_seq_len: int = 256
    pack: bool = True
    seed: int = 0

    def __post_init__(self):
        check_range("eval_fraction", self.eval_fraction, 0.0, 1.0, high_open=True)
        check_range("max_seq_len", self.max_seq_len, 2)
        check_range("seed", self.seed, 0)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping. A step consumes `grad_accum` micro-batches of `batch_size` rows (for dpo and
    reward: pairs; for grpo: prompts, each sampled `group_size` times).

    objective: sft (masked cross-entropy), dpo (preference optimisation, [dpo]), reward (a Bradley-Terry reward
    model), grpo (online RL against a reward, [grpo]) or distill (from a teacher, [distill]).

    schedule: warmup (linear, `warmup_steps`) then "cosine", "linear" (to `min_lr_ratio` x lr) or "constant".
    max_steps: 0 trains `epochs` epochs. eval_every / checkpoint_every: in steps (0: at epoch ends / at the end).
    max_nonfinite_steps: the run stops after this many non-finite steps in a row (each is skipped and counted).
    """

    objective: str = "sft"
    output_dir: str = "runs/run"
    epochs: int = 1
    max_steps: int = 0
    batch_size: int = 8
    grad_accum: int = 1
    learning_rate: float = 2e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    max_nonfinite_steps: int = 10
    resume_step: int = -1

    def __post_init__(self):
        check_choice("objective", self.objective, OBJECTIVES)
        check_choice("schedule", self.schedule, ("cosine", "linear", "constant"))
        if not self.output_dir:
            raise ConfigError("output_dir", self.output_dir, "needs a directory")
        for name in ("epochs", "batch_size", "grad_accum", "log_every", "keep_checkpoints", "max_nonfinite_steps"):
            check_range(name, getattr(self, name), 1)
        for name in ("max_steps", "warmup_steps", "eval_every", "checkpoint_every", "seed"):
            check_range(name, getattr(self, name), 0)
        check_range("learning_rate", self.learning_rate, 0)
        check_range("min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_range("weight_decay", self.weight_decay, 0)
        check_range("adam_b1", self.adam_b1, 0, 1, high_open=True)
        check_range("adam_b2", self.adam_b2, 0, 1, high_open=True)
        check_range("adam_eps", self.adam_eps, 0, low_open=True)
        check_range("max_grad_norm", self.max_grad_norm, 0, low_open=True)
        check_range("resume_step", self.resume_step, -1)


@dataclass(frozen=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    method: MethodConfig = field(default_factory=MethodConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    dpo: PreferenceConfig = field(default_factory=PreferenceConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # an unquoted string


TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", tuple: "a list"}
PATTERN_KEYS = ("rank_pattern", "alpha_pattern")  # TOML tables: {"regex" = value, ...}
REGEX_KEYS = ("target_modules", "exclude_modules")  # a string is a regular expression (PEFT's string form)


def _value(section: str, key: str, value, expected: type):
    """`value` as the field's type, or a ConfigError naming section.key and the type it needs."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is tuple and key in PATTERN_KEYS and isinstance(value, dict):
        return value
    if expected is tuple and key in REGEX_KEYS and isinstance(value, str):
        return value
    if expected is tuple and isinstance(value, (list, str)):
        return tuple([value] if isinstance(value, str) else value)
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        raise ConfigError(f"{section}.{key}", value, f"must be {TYPE_NAMES.get(expected, expected.__name__)}")
    return value


def _located(error: ConfigError, source: str) -> JaxtuneError:
    """One line: `run.toml: train.learning_rate = -0.001: must be > 0`, or for an override that names the field
    itself, `--set train.learning_rate=-0.001: must be > 0`."""
    if source.startswith("--set") and "[" not in error.field:
        return JaxtuneError(f"{source}: {error.valid}")
    return JaxtuneError(f"{source}: {error}")


def _build(raw: dict, where: str, overridden: dict[tuple[str, str], str]) -> RunConfig:
    """`overridden`: (section, key) -> the `--set` item that gave it, named in its errors instead of the file."""
    sections = {}
    for name, values in raw.items():
        if name not in SECTIONS:
            raise JaxtuneError(f"{where}: unknown section [{name}] (sections: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise JaxtuneError(f"{where}: [{name}] must be a table")
        cls = type(SECTIONS[name]())
        known = {f.name: f for f in dataclasses.fields(cls)}
        source = lambda key: f"--set {overridden[name, key]}" if (name, key) in overridden else where
        for key, value in values.items():
            if key not in known:
                raise JaxtuneError(f"{source(key)}: unknown key {key!r} in section [{name}] "
                                   f"(known: {', '.join(known)})")
            try:
                values[key] = _value(name, key, value, type(getattr(cls(), key)))
            except ConfigError as e:
                raise _located(e, source(key)) from None
        try:
            sections[name] = cls(**values)
        except ConfigError as e:
            raise _located(e.in_section(name), source(e.field.split("[")[0])) from None
    return RunConfig(**sections)


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML run config (or start from defaults when `path` is None) and apply "section.key=value" overrides."""
    raw: dict = {}
    where = "config"
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.is_file():
            raise JaxtuneError(f"{path}: config file not found")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise JaxtuneError(f"{path}: invalid TOML: {e}") from None
    overridden = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise JaxtuneError(f"--set {item!r}: expected section.key=value")
        raw.setdefault(section, {})[name] = _parse_value(value.strip())
        overridden[section, name] = item
    return _build(raw, where, overridden)


def _toml_value(value) -> str:
    if isinstance(value, tuple) and value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        return "{" + ", ".join(f"{_toml_value(k)} = {_toml_value(v)}" for k, v in value) + "}"  # a pattern table
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def config_items(config: RunConfig) -> dict[str, object]:
    """The config flattened to "section.key" -> a JSON value (tuples as lists), as checkpoints record it."""
    return json.loads(json.dumps({f"{name}.{f.name}": getattr(getattr(config, name), f.name)
                                  for name in SECTIONS for f in dataclasses.fields(getattr(config, name))}))


def dump_run_config(config: RunConfig) -> str:
    """The config as TOML text that `load_run_config` reads back to an equal config."""
    lines = []
    for name in SECTIONS:
        lines.append(f"[{name}]")
        section = getattr(config, name)
        lines += [f"{f.name} = {_toml_value(getattr(section, f.name))}" for f in dataclasses.fields(section)]
        lines.append("")
    return "\n".join(lines)
