"""Reading and writing a training run's TOML: `RunConfig`, one frozen dataclass with a field per section.

    [model] [method] [data] [train] [mesh] [offload]   the sections of `jaxtune.config` (run.py, method.py)
    [dpo] [grpo] [distill] ...                          each registered objective's own section, if it has one
    config = load_run_config("run.toml", ["train.learning_rate=1e-4"])   # `--set` items: TOML values, or bare text
    text = dump_run_config(config)                                       # TOML that reads back to an equal config

The section dataclasses validate their own values; this module reads TOML into them, names where a bad value came
from (the file, or the `--set` item), and refuses an unknown section or key, naming the known ones.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from jaxtune.config import DataConfig, EvalConfig, MeshConfig, MethodConfig, ModelSection, OffloadConfig, TrainConfig
from jaxtune.config.run import context_split_error
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.objectives import objective_named
from jaxtune.objectives.cpo import CPOConfig, SimPOConfig
from jaxtune.objectives.distill import DistillConfig
from jaxtune.objectives.dpo import PreferenceConfig
from jaxtune.objectives.grpo import GRPOConfig
from jaxtune.objectives.kto import KTOConfig
from jaxtune.objectives.orpo import ORPOConfig
from jaxtune.objectives.rloo import RLOOConfig


@dataclass(frozen=True)
class RunConfig:
    """A training run: a field per TOML section, every one defaulted. After the run's own sections, one per
    registered objective that has a section, named as the objective (tests/test_run_config.py keeps them in step
    with `objectives.OBJECTIVES`)."""

    model: ModelSection = field(default_factory=ModelSection)
    method: MethodConfig = field(default_factory=MethodConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dpo: PreferenceConfig = field(default_factory=PreferenceConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rloo: RLOOConfig = field(default_factory=RLOOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    orpo: ORPOConfig = field(default_factory=ORPOConfig)
    cpo: CPOConfig = field(default_factory=CPOConfig)
    simpo: SimPOConfig = field(default_factory=SimPOConfig)
    kto: KTOConfig = field(default_factory=KTOConfig)


SECTIONS: dict[str, type] = typing.get_type_hints(RunConfig)  # section name -> its dataclass, in TOML order


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # an unquoted string


TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", tuple: "a list"}
PATTERN_KEYS = ("rank_pattern", "alpha_pattern", "columns")  # TOML tables: {"regex" = value, ...}, {ours = theirs}
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
        cls = SECTIONS[name]
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
            if name == "train":
                objective_named(sections[name].objective)
        except ConfigError as e:
            raise _located(e.in_section(name), source(e.field.split("[")[0])) from None
    config = RunConfig(**sections)
    why = context_split_error(config.data.max_seq_len, config.mesh.context)
    if why:
        raise JaxtuneError(f"{where}: [data] max_seq_len = {config.data.max_seq_len} {why}")
    if config.offload.moments_dtype != "float32" and config.train.optimizer != "adamw":
        raise JaxtuneError(f"{where}: [offload] moments_dtype = {config.offload.moments_dtype!r} is for [train] "
                           f"optimizer = 'adamw', not {config.train.optimizer!r}")
    if config.train.objective in ("grpo", "rlhf", "rloo") and config.mesh.context > 1:
        raise JaxtuneError(f"{where}: [train] objective = {config.train.objective!r} with [mesh] context = "
                           f"{config.mesh.context}: its rollouts decode whole rows, which a context axis would split; "
                           "use a mesh without one")
    return config


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
